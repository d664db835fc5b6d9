"""The feature store: the target's hidden states per conversation, in sharded safetensors files.

manifest.py   the store's identity (what decides its contents), the manifest and what a reader accepts
writer.py     the shard plan, the output directory (resume or refuse), shards + sidecars, the manifest
reader.py     FeatureStore: checked random access (safe_open slices), open_store for training
shard.py      one shard file: the deterministic streamed writer, the defensive header parser
codec.py      the stored dtypes: bfloat16 / float16 / float32 as they are, fp8 with per-token scales
"""
