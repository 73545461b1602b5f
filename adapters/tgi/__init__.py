"""vattn for Hugging Face TGI's server (``text_generation_server`` v3.3.7).

Enable with ``VATTN_TGI=1`` in the server process; see :mod:`.activate` and README.md.
Importing this package imports neither TGI nor torch-heavy parts of it.
"""

from .version import TGI_VERSION

__all__ = ["TGI_VERSION"]
