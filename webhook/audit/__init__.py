"""The cluster audit: workloads already running, run through the same engine as admission, reported
as PolicyReports."""
