"""One dtype, every spelling: `bf16` and `bfloat16` (and torch's names) mean the same wherever a flag
takes a dtype (`extract --dtype --logprob-dtype --hidden-dtype`, `store convert --hidden-dtype`,
`export --dtype`, `eval --target-dtype`, `demo --hidden-dtype`).

Each flag keeps its own list of allowed dtypes, written in one spelling (the one stores, configs and
checkpoints record, so nothing on disk changes); :func:`dtype_choice` maps any accepted spelling to it.
"""

from __future__ import annotations

from peagle.schemas.errors import UserError

_SPELLINGS = (
    ("bfloat16", "bf16", "torch.bfloat16"),
    ("float16", "fp16", "half", "torch.float16"),
    ("float32", "fp32", "float", "torch.float32"),
    ("float64", "fp64", "double", "torch.float64"),
    ("fp8", "float8", "float8_e4m3fn", "torch.float8_e4m3fn"),
)
FAMILY = {spelling: names[0] for names in _SPELLINGS for spelling in names}
"""Every accepted spelling -> one name per dtype."""


def dtype_choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    """``value`` written the way ``allowed`` writes it (``bfloat16`` -> ``bf16`` where ``allowed`` says
    ``bf16``, and the other way round); words that are no dtype (``auto``) must match as they are.

    Raises:
        UserError: ``value`` is not one of ``allowed`` in any spelling (naming the flag and the choices).
    """
    if value in allowed:
        return value
    family = FAMILY.get(str(value).lower())
    for choice in allowed:
        if family is not None and FAMILY.get(choice) == family:
            return choice
    spelled = [f"{c} ({'/'.join(_other_spellings(c))})" if _other_spellings(c) else c for c in allowed]
    raise UserError(f"--{flag} must be one of {', '.join(spelled)}, got {value!r}")


def _other_spellings(choice: str) -> list[str]:
    """The other common spelling of ``choice`` (``bf16`` for ``bfloat16``), for error messages."""
    names = next((names for names in _SPELLINGS if choice in names), ())
    return [name for name in names[:2] if name != choice]
