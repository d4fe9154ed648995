"""The admission webhook: AdmissionReview bytes to answer bytes (`review`, pure), the raw ASGI endpoints
(`app`) and their HTTPS server (`server`). Never talks to the Kubernetes API itself."""
