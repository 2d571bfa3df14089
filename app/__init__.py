"""The Serve application. Public surface: ``build_app`` and the config models."""

from app.config import AppConfig

__all__ = ["AppConfig", "build_app"]


def __getattr__(name):
    # Lazy: importing app.config or app.errors must not pull in Ray Serve and FastAPI.
    if name == "build_app":
        from app.builder import build_app

        return build_app
    raise AttributeError(name)
