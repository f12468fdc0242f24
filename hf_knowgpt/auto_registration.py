"""Registering KnowGPT with transformers' Auto classes and the "birthplace-qa" pipeline task, as late as
possible.

`import hf_knowgpt` must stay cheap (it loads neither torch nor transformers), yet after it
`AutoModelForCausalLM.from_pretrained(path)` must know KnowGPT. So each registration runs when the
transformers module it extends is first imported (an import hook on four module names), or at once when
that module is already loaded. `register_auto_classes()` does all of them now.
"""

import importlib.abc
import sys
import threading

_DONE = set()
_PENDING = []
_LOCK = threading.RLock()
_BUSY = False


def _register_config():
    from transformers import AutoConfig

    from .configuration_knowgpt import KnowGPTConfig

    AutoConfig.register(KnowGPTConfig.model_type, KnowGPTConfig, exist_ok=True)


def _register_models():
    from transformers import AutoModel, AutoModelForCausalLM

    from .configuration_knowgpt import KnowGPTConfig
    from .modeling_knowgpt import KnowGPTForCausalLM, KnowGPTModel

    AutoModel.register(KnowGPTConfig, KnowGPTModel, exist_ok=True)
    AutoModelForCausalLM.register(KnowGPTConfig, KnowGPTForCausalLM, exist_ok=True)


def _register_tokenizer():
    from transformers import AutoTokenizer

    from .configuration_knowgpt import KnowGPTConfig
    from .tokenization_knowgpt import KnowGPTTokenizerFast

    AutoTokenizer.register(KnowGPTConfig, fast_tokenizer_class=KnowGPTTokenizerFast, exist_ok=True)


def _register_pipeline():
    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    from .pipeline_birthplace_qa import BirthplaceQAPipeline

    if "birthplace-qa" not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(
            "birthplace-qa", pipeline_class=BirthplaceQAPipeline, pt_model=AutoModelForCausalLM, type="text"
        )


# transformers module → what registers with it once it is loaded
REGISTRATIONS = {
    "transformers.models.auto.configuration_auto": _register_config,
    "transformers.models.auto.modeling_auto": _register_models,
    "transformers.models.auto.tokenization_auto": _register_tokenizer,
    "transformers.pipelines": _register_pipeline,
}


def _run(module_name: str):
    """Run a registration, or queue it while another one runs: registering imports our modules, and a
    registration that fired inside that import would meet them half-initialized."""
    global _BUSY
    with _LOCK:
        if module_name in _DONE or module_name in _PENDING:
            return
        _PENDING.append(module_name)
        if _BUSY:
            return
        _BUSY = True
        try:
            while _PENDING:
                name = _PENDING[0]
                REGISTRATIONS[name]()
                _DONE.add(name)
                _PENDING.pop(0)
        finally:
            _BUSY = False
            _PENDING.clear()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched modules it asks the other finders and wraps the loader, so the
    registration runs right after the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in REGISTRATIONS or fullname in _DONE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            _run(fullname)

        loader.exec_module = exec_module
        return spec


_HOOK = _RegisterAfterImport()


def install():
    """Register with every watched module that is loaded, and hook the imports of the others."""
    for name in REGISTRATIONS:
        if name in sys.modules:
            _run(name)
    if not all(name in _DONE for name in REGISTRATIONS) and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def register_auto_classes():
    """Register everything now (imports transformers' Auto modules and pipelines)."""
    for name in REGISTRATIONS:
        importlib.import_module(name)
        _run(name)


__all__ = ["install", "register_auto_classes"]
