"""SGLang's CPU import set needs the torchvision stand-in of ``tests/adapters/sglang/conftest.py``
(installed when that module is imported, only where sglang is and torchvision is not)."""

import tests.adapters.sglang.conftest  # noqa: F401
