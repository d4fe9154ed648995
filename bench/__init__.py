"""gpuguard's performance benches: run them with `bench/run`. The suite only smoke-tests the admission,
hotpath, cores and fleet benches at a tiny size (tests/e2e/test_bench_*.py); their figures and floors are
the benches' own."""

# The exit code of a bench that ran to the end but missed a floor: apart from Python's 1 for an uncaught
# exception, so that a crashed run never passes for "a floor missed on a busy machine".
FLOOR_MISSED = 3
