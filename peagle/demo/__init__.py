"""The demo's recipe parts, above the stages (as torchtune keeps ``recipes/`` over its library):
``peagle demo``'s tiny target (:mod:`.target`, built on :mod:`.tiny_target` and trained by
:mod:`.target_training` on :mod:`.stdlib_docs`) and its chat prompts (:mod:`.chat_prompts`, also the
held-out prompts of the benchmarks). Product code: ``peagle/testing`` holds only fixtures and fault
helpers, and no product module imports it (tests/test_imports.py)."""
