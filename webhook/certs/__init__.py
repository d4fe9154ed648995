"""Certificates: file names (`files`, no crypto import), generation and the rotation plan (`tls`), the
switchable serving certificate (`serving`) and the loop that keeps the Secret and caBundles current
(`controller`)."""
