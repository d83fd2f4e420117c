"""Every private ``torch.distributed`` surface dtprobe relies on, in one place, each with what it is and why.

torch changes these between releases without notice; keeping them here means a torch upgrade breaks one module,
and the tests of this module (``tests/test_torch_internals.py``) say which surface moved. Checked against the torch
this project installs (2.13). Nothing else in dtprobe reaches into ``torch.distributed``'s private names.
"""

from __future__ import annotations
