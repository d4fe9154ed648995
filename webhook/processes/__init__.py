"""One composition root per long-running process: serve (and its workers), controllers."""
