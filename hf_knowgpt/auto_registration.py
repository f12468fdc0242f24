"""Registering KnowGPT with transformers' Auto classes and the "birthplace-qa" pipeline task, as late as
possible.

`import hf_knowgpt` must stay cheap (it loads neither torch nor transformers), yet after it
`AutoModelForCausalLM.from_pretrained(path)` must know KnowGPT. So each registration runs when the
transformers module it extends is first imported (an import hook on four module names), or at once when
that module is already loaded, and never while one of this package's own modules is half-imported.
`register_auto_classes()` does all of them now.
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


# Our modules that registrations import: a registration waits while one of them is half-imported (a watched
# transformers module can load in the middle of importing ours, e.g. modeling_layers → models.auto).
OUR_MODULES = tuple(
    f"hf_knowgpt.{name}"
    for name in (
        "configuration_knowgpt",
        "attention_knowgpt",
        "modeling_knowgpt",
        "tokenization_knowgpt",
        "pipeline_birthplace_qa",
    )
)


def _initializing(module_name: str) -> bool:
    spec = getattr(sys.modules.get(module_name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _flush(finished: str | None = None):
    """Run the queued registrations, unless one is running or one of our modules (other than `finished`,
    whose body has just run) is still being imported; the end of that import flushes again."""
    global _BUSY
    with _LOCK:
        if _BUSY or any(_initializing(name) for name in OUR_MODULES if name != finished):
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


def _loaded(module_name: str):
    """A watched transformers module has loaded: queue what registers with it, and run the queue."""
    with _LOCK:
        if module_name not in _DONE and module_name not in _PENDING:
            _PENDING.append(module_name)
    _flush()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched transformers modules and our own, it asks the other finders and
    wraps the loader, so that queued registrations run right after the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname in REGISTRATIONS:
            if fullname in _DONE:
                return None
            after = _loaded
        elif fullname in OUR_MODULES:
            after = lambda name: _flush(finished=name)  # noqa: E731
        else:
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
            after(fullname)

        loader.exec_module = exec_module
        return spec


_HOOK = _RegisterAfterImport()


def install():
    """Register with every watched module that is loaded, and hook the imports of the others."""
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    for name in REGISTRATIONS:
        if name in sys.modules:
            _loaded(name)


def register_auto_classes():
    """Register everything now (imports transformers' Auto modules and pipelines)."""
    for name in REGISTRATIONS:
        importlib.import_module(name)
        _loaded(name)


__all__ = ["install", "register_auto_classes"]
