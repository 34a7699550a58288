"""A module whose import the hostile-input test watches for: a registration over HTTP that
names a function here (outside the allowed plug-in modules) must be refused before it is
imported."""


def reward(args, sample):  # a valid reward's signature: only the module's path is refused
    return 0.0
