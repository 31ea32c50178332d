"""Secrets in ``cache.storage_options``: written as references, resolved only where a store opens.

A value may reference an environment variable (``"${AWS_SECRET_ACCESS_KEY}"``, also inside a
longer string; ``$${`` writes a literal ``${``) or a named secret of a registered resolver
(``"prefect-secret:NAME"``).  The config keeps the reference: the saved ``config.toml``, logs
and anything passed between processes never hold the value, which exists only in the dict
handed to ``open_cache``.

Resolvers are a hook, so that only ``flows/`` imports Prefect: at start it calls
``register_resolver("prefect-secret", lambda name: Secret.load(name).get())``.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from diffsynth_core.errors import InputError, SplitflowError

_RESOLVERS: dict[str, Callable[[str], str]] = {}
# schemes users may write before anything registered them: an unregistered one is an error, not text
KNOWN_SCHEMES = {"prefect-secret": "a Prefect Secret block (resolved when splitflow runs its Prefect flows)"}
_ENV_REF = re.compile(r"\$\$\{|\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SCHEME_REF = re.compile(r"^([a-z][a-z0-9+.-]*):(\S+)$")
_SENSITIVE = re.compile(r"secret|password|passwd|token|credential|access_key|(^|_)key$", re.IGNORECASE)


def register_resolver(scheme: str, resolve: Callable[[str], str]) -> None:
    """Resolve values written ``"<scheme>:NAME"`` with ``resolve(NAME)`` (replaces an earlier one)."""
    _RESOLVERS[scheme] = resolve


def unregister_resolver(scheme: str) -> None:
    _RESOLVERS.pop(scheme, None)


def _scheme_of(text: str) -> tuple[str, str] | None:
    match = _SCHEME_REF.match(text)
    if match and (match.group(1) in _RESOLVERS or match.group(1) in KNOWN_SCHEMES):
        return match.group(1), match.group(2)
    return None


def _resolve_text(text: str, where: str) -> str:
    scheme = _scheme_of(text)
    if scheme is not None:
        name, ref = scheme
        if name not in _RESOLVERS:
            raise InputError(f"{where} = {text!r} names {KNOWN_SCHEMES[name]}, but nothing resolves "
                             f"{name}: references here; run through the splitflow CLI or use ${{ENV_VAR}}")
        try:
            return _RESOLVERS[name](ref)
        except SplitflowError:
            raise
        except (ValueError, KeyError, LookupError) as err:
            raise InputError(f"{where}: cannot resolve {text!r}: {err}") from None

    def env(match: re.Match) -> str:
        if match.group(0) == "$${":
            return "${"
        value = os.environ.get(match.group(1))
        if value is None:
            raise InputError(f"{where} references ${{{match.group(1)}}}, which is not set in this "
                             "environment; export it (or fix the name)")
        return value

    return _ENV_REF.sub(env, text)


def resolve(value: Any, where: str) -> Any:
    """``value`` with every reference replaced by what it names (dicts and lists recursed)."""
    if isinstance(value, str):
        return _resolve_text(value, where)
    if isinstance(value, dict):
        return {k: resolve(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def storage_options(cache_section) -> dict[str, Any] | None:
    """The resolved ``cache.storage_options`` for ``open_cache`` (None when there are none)."""
    return resolve(dict(cache_section.storage_options), "cache.storage_options") or None


def is_reference(text: str) -> bool:
    return bool(_ENV_REF.search(text)) or _scheme_of(text) is not None


def literal_secrets(value: Any, where: str) -> list[str]:
    """Dotted keys under ``where`` whose name looks sensitive and whose value is not a reference."""
    found = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        dotted = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
        if isinstance(item, (dict, list)):
            found += literal_secrets(item, dotted)
        elif isinstance(item, str) and item and _SENSITIVE.search(str(key)) and not is_reference(item):
            found.append(dotted)
    return found
