"""Running shard sets: the residency plan, the weight store, the streaming model, routed experts and the ledger."""
