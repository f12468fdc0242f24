"""Package namespaces whose names load from their modules on first use (PEP 562), so that importing a
package costs nothing until something in it is used."""

import importlib


def lazy_exports(package: str, exports: dict[str, list[str]]):
    """(`__getattr__`, `__dir__`, `__all__`) for `package`, whose names are `exports` (module → names)."""
    module_of = {name: module for module, names in exports.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name):
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module_of[name]}", package), name)
        namespace[name] = value  # the next lookup finds it directly
        return value

    def __dir__():
        return sorted([*namespace, *module_of])

    return __getattr__, __dir__, sorted(module_of)


__all__ = ["lazy_exports"]
