"""Certificates (`import webhook.certs.files` never loads cryptography):

files.py     the serving files' layout and names, without `cryptography`
tls.py       a small CA, serving and client certificates, and the rotation plan
serving.py   what the TLS listener presents, switchable while it runs
rotation.py  the loop that keeps the Secret and both webhook configurations' caBundles current,
             and rotates before expiry
"""
