"""gpuguard's performance bench (issue 6): not part of the test suite; run it with `bench/run`."""

# The exit code of a bench that ran to the end but missed a floor: apart from Python's 1 for an uncaught
# exception, so that a crashed run never passes for "a floor missed on a busy machine".
FLOOR_MISSED = 3
