"""Infinijup's privileged helper: a root daemon that launches kernels in their own PID
namespaces and dumps and restores them with CRIU on behalf of the calling user.

The wire contract is docs/protocol.md; the client is ``infinijup.helper_client``.
"""
