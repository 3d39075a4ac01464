"""Experiment trackers (TensorBoard, W&B, MLflow, Trackio) for `peagle train` and `peagle eval`.

Shared by both stages, so it lives below them: :mod:`.scalars` names what is logged (pure),
:mod:`.preflight` checks before any work that every backend asked for can run (its package, its
login, its server), :mod:`.backends` speaks to each library, and :mod:`.tracker` forwards the
trainer's metrics records to them from a thread of its own and keeps ``RUN_DIR/trackers.json`` (the
run ids a resume and `peagle eval` continue).
"""
