"""The torch-free schema layer: every document compress reads or writes, as pydantic models.

* ``base`` (the Strict base, bounded numbers) and ``yamlio`` (the bounded YAML reader);
* the recipe: ``recipe`` (Recipe and its sections), ``quantize``, ``kv_cache``, ``prune``,
  ``distill``, ``exports``, ``devices``, ``metrics`` (the configs the stages and exports take);
* the outputs: ``manifest`` (manifest.json) and ``report`` (report.json);
* ``documents``: the three documents' JSON Schemas (`compress schema`, docs/schemas/).

Nothing here imports torch, transformers or any compress module outside this package and
compress.errors (tests/test_schema.py checks), so `import compress` and `compress validate`
stay cheap. Every module imports these models from here, the one place each is defined.
"""
