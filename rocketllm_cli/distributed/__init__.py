"""Pipeline stages over torch.distributed: one model split into contiguous layer ranges, one per process (rank),
launched by torchrun. `launch.py` reads the launcher's environment (torch-free), `plan.py` splits the layers by the cost
model (torch-free), `group.py` is the process group (gloo or NCCL), its liveness and its messages, `opening.py` joins
the ranks and opens each one's stage, and `stages.py` runs this rank's share of a shard set and passes hidden states
from rank to rank."""
