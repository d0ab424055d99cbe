"""A kind's options validated by its pydantic dataclass, with one message form for every kind:
the option, the value given, what is wrong, and the options there are. Light: pydantic only."""

from __future__ import annotations

from pydantic import ValidationError


def validate(schema, options: dict, kind: str):
    """`schema(**options)`, or ValueError naming the first option that is not allowed."""
    try:
        return schema(**options)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"]) or "options"
        given = options.get(err["loc"][0], "(missing)") if err["loc"] else options
        raise ValueError(f"{kind} option {key}={given!r} is not allowed: {err['msg']}; options: "
                         f"{', '.join(schema.__dataclass_fields__)}") from None
