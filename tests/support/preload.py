"""What every rank needs, imported once by the forkserver the ranks fork from
(``tests/support/dist.py``): a rank then starts with torch, DTensor, FSDP2, meshgroups' torch
side and pytest already loaded, instead of spending about a second of CPU importing them after
the fork — eight ranks at once on two cores, for each job. Never imported by pytest itself
(``conftest.py`` stays torch-free).

Public names only, resolved here so the lazy package fronts load their modules now::

    >>> import tests.support.preload as preload
    >>> preload.LOADED
    True
"""

from __future__ import annotations

import pytest
import torch.distributed.fsdp
import torch.distributed.tensor

import meshgroups.elastic
import meshgroups.mesh
import meshgroups.transfer

# touching a name of each front imports its private modules (the torch seam checks torch's
# source at import: the most costly part)
_ = (meshgroups.mesh.init_mesh, meshgroups.elastic.Elastic, meshgroups.transfer.WeightSync)
# a rank imports the test module, hence pytest, to unpickle the function it runs
_ = (pytest, torch.distributed.tensor, torch.distributed.fsdp)
LOADED = True
