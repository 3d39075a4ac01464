"""Training methods: the same store, loader workers, loss, resume, DDP and metrics, two ways to draft.

* ``peagle`` (:mod:`.peagle`, the default): P-EAGLE, all K tokens in one forward (COD sampling,
  mask slots);
* ``eagle3`` (:mod:`.eagle3`): EAGLE-3 with training-time test, one forward per token, each reading
  the previous one's hidden state.

The interface (what an item is, how a batch is collated, how a unit runs forward) is
:class:`.method.TrainingMethod`; a third method is one more file here and one line below
(docs/methods.md).
"""

from __future__ import annotations

from peagle.schemas.errors import UserError
from peagle.stages.train.methods.eagle3 import EAGLE3
from peagle.stages.train.methods.method import TrainingMethod
from peagle.stages.train.methods.peagle import PEAGLE

METHODS: dict[str, TrainingMethod] = {method.name: method for method in (PEAGLE, EAGLE3)}


def training_method(name: str) -> TrainingMethod:
    """The method called ``name`` (``--method``).

    Raises:
        UserError: an unknown name, in one line listing the known ones.
    """
    if name not in METHODS:
        raise UserError(f"unknown training method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "PEAGLE", "EAGLE3", "TrainingMethod", "training_method"]
