"""Writing shard sets: checkpoint sources, safetensors and GGUF headers, unit discovery, the manifest, model facts."""
