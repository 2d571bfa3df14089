"""build_app: the one place that binds the deployments into a Serve application.

``serve run serve_config.yaml`` calls ``build_app(args)`` with the YAML's ``args:``; a bad
value raises pydantic's ValidationError here, which fails the deploy with a message naming
the field and its allowed range.
"""

from __future__ import annotations

import logging

from ray.serve import Application

from app.config import AppConfig

logger = logging.getLogger("ray.serve")


def build_app(args: dict | None = None) -> Application:
    config = AppConfig.model_validate(args or {})
    if config.model.build_preset:
        from app.model_builder import ensure_model

        ensure_model(config.model.resolved_path(), config.model.build_preset)
    # Deployments get the config with the model path made absolute: replicas do not
    # share the driver's working directory.
    resolved = config.model_copy(
        update={"model": config.model.model_copy(update={"path": str(config.model.resolved_path())})}
    )
    payload = resolved.model_dump(mode="json")

    from app.ingress import ingress_deployment
    from deployments.compute.deployment import worker_deployment
    from deployments.router.deployment import router_deployment

    dataplane = None
    if resolved.dataplane.enabled:
        from deployments.dataplane.deployment import dataplane_deployment

        dataplane = dataplane_deployment(resolved).bind(payload)
    worker = worker_deployment(resolved).bind(payload, dataplane)
    router = router_deployment(resolved).bind(worker, payload, dataplane)
    return ingress_deployment(resolved).bind(router, payload, dataplane)
