"""bucketserve: disaggregated prefill/decode LLM serving.

The public Python API lives here; the components live in the top-level
packages named in DESIGN.md (runtime, bucket_manager, prefill_worker,
decode_worker, kv_transfer, gateway, deploy).
"""

__version__ = "0.1.0"
