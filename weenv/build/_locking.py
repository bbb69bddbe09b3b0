"""Locking a plan against the registry, with image-config defaults (glue between plan and registry).

Groups imported with ``weenv pull`` keep their image config (Env, WorkingDir, User); a lock
takes them as defaults: the plan's own values win, and a higher group's image wins over a lower one's.
"""

from __future__ import annotations

from ..plan import Lock, Plan, apply_image_defaults, lock_plan, plan_defaults_from_image


def lock_with_image_defaults(plan: Plan) -> Lock:
    from ..registry import image_config, resolve_group

    lock = lock_plan(plan, resolve_group)
    for g in reversed(lock.groups):  # top first: apply_image_defaults only fills what is still unset
        defaults = plan_defaults_from_image(image_config(g.pinned_ref))
        if defaults:
            lock = apply_image_defaults(lock, defaults)
    return lock
