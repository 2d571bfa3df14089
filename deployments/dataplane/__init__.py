"""The data plane: sessions and KV blocks in host memory (L2) in front of Redis (L3)."""

from deployments.dataplane.types import SessionRecord, new_session_id

__all__ = ["SessionRecord", "new_session_id"]
