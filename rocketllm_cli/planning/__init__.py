"""`rocketllm plan`: whole configurations of a model on a machine, from headers and the measured profile, ranked by
the cost model's projection (planner.py over formats.py's weight formats, projection.py's memory and speed per row,
stages.py over several hosts, whatif.py's other hardware, commandlines.py's lines that run a row, report.py's words).
Above profiles/ and shard/, whose figures and headers it reads, and beside distributed/, whose stage planner it asks."""
