"""The cluster audit: workloads already running, run through the same engine as admission, reported
as PolicyReports.

The pure core (objects in; findings, report bodies and table rows out):

    findings.py    each workload through `engine.mutate`, then `engine.validate`: findings
    reports.py     findings as the body of a PolicyReport, the same twice for the same findings
    output.py      the audit as a table grouped by namespace, and as JSON data
    schedule.py    when the background audit runs next, and what its runs found (its metrics)

Its cluster side, through webhook.kube:

    scan.py        the cluster listed page by page into the core, one report written per namespace
    background.py  the reports kept current on an interval: a runnable for the controllers' leader
"""
