"""The sharding/streaming core: checkpoint -> per-unit shards -> tiered weights -> transformers forward."""
