"""The tests' liveness bounds: how long a wait may last before a test calls it a hang. They assert no speed: a
healthy run takes a small part of each, even on a two-core CI machine shared with other jobs, and only a stuck
wait reaches one."""

HANG_TIMEOUT_S = 30  # a thread, future, event, barrier or coroutine that ends in about a second when all is well
CHILD_PROCESS_TIMEOUT_S = 120  # a spawned Python process: it imports torch, then serves or compiles something tiny
BENCH_RUN_TIMEOUT_S = 240  # a whole `bench/*.py --tiny` run, its Triton kernels under the interpreter
