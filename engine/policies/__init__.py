"""KV policies: importing this package registers every built-in policy by name.

The imports run in registration order, which is the order `kvarena list` and the help show.
"""
# ruff: isort: skip_file

from engine.policies import full  # noqa: F401
from engine.policies import kara  # noqa: F401
from engine.policies import zipage  # noqa: F401
from engine.policies import snapkv  # noqa: F401
from engine.policies import chunkkv  # noqa: F401
from engine.policies import growpage, growpage_variants  # noqa: F401
from engine.policies import rkv, morphkv, gkv  # noqa: F401
from engine.policies import streamingllm, h2o, tova  # noqa: F401
from engine.policies import pyramidkv  # noqa: F401
from engine.policies import adakv  # noqa: F401
from engine.policies.base import POLICIES, Action, Decision, KVPolicy, build_policy

__all__ = ["POLICIES", "Action", "Decision", "KVPolicy", "build_policy"]
