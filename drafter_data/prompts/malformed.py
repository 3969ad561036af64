"""The one exception of record normalization: the record does not have the shape its format needs."""


class Malformed(Exception):
    """args[0] is the reason (a stats.json key, e.g. `missing_field`), args[1] the detail for the rejects file."""
