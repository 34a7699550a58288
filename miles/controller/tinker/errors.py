"""The Tinker gateway's refusals, one class per HTTP status (the routes map them by type)."""

from __future__ import annotations


class GatewayError(Exception):
    """A request the gateway refuses; `status` is its HTTP status. The SDK retries none of them,
    except those marked `retryable` (sent without `x-should-retry: false`)."""

    status = 400
    retryable = False


class GatewayNotFoundError(GatewayError):
    status = 404


class GatewayBodyTooLargeError(GatewayError):
    status = 413


class GatewayInUseError(GatewayError):
    """A deletion refused because something still uses the object; the message names what.

    HTTP 400, not 409: the SDK's RestClient retries a 409 for five minutes whatever
    `x-should-retry` says, and waiting does not free a model's resume point."""


class GatewaySessionFinishedError(GatewayError):
    """A heartbeat for a finished session (HTTP 410: the SDK stops its heartbeat loop)."""

    status = 410


class GatewayCapacityError(GatewayError):
    """No free slot for a new model (HTTP 409, marked not to be retried)."""

    status = 409


class GatewayBusyError(GatewayError):
    """A paged-out model's command found no free slot to page it back into (HTTP 429, which
    the SDK retries with backoff, as it does 408/409/5xx): nothing was logged, and the same
    call sent again pages the model in once a slot frees."""

    status = 429
    retryable = True
