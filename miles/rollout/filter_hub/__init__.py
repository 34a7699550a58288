"""Miles' import path for filter types, so filters written for Miles import unchanged."""
