"""What a checkpoint's files say, read without the weights: safetensors headers, GGUF headers and GGML blocks, the
facts the profile derives knobs from, and a shard set's manifest. Below profiles: every layer above reads them."""
