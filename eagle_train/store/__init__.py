"""The feature store: the target's hidden states per conversation, in sharded safetensors files.

manifest.py   the store's identity (what decides its contents), the manifest and what a reader accepts
writer.py     the one shard planner, the output directory (resume or refuse), ShardWriter (a shard + its
              sidecar, pushed batch by batch), the manifest
reader.py     FeatureStore: checked random access (safe_open slices), open_store for training
shard.py      one shard file: its deterministic push-style writer, the defensive header parser
codec.py      the stored dtypes: bfloat16 / float16 / float32 as they are, fp8 with per-token scales
"""
