"""The admission webhook: AdmissionReview bytes in, answer bytes out. Never talks to the Kubernetes
API itself: the cluster facts it reads are handed in (webhook.processes.serve wires them).

    review.py   AdmissionReview bytes to answer bytes (pure: the policy engine, no framework)
    app.py      the admission endpoints as raw ASGI, in front of the probes app; the decision log line
    server.py   the app under uvicorn over TLS, with the settings the API server's client calls for
"""
