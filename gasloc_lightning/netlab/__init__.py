"""A network lab on one machine: sites as network namespaces, shaped links between them, real link faults.

- :mod:`~gasloc_lightning.netlab.plan`: the sites, addresses and link rates of a ``network=`` preset (pure);
- :mod:`~gasloc_lightning.netlab.lab`: the namespaces, veth links and htb shapers, and their removal;
- :mod:`~gasloc_lightning.netlab.faults`: ``partition``, ``flap`` and ``slow`` on a site's link;
- :mod:`~gasloc_lightning.netlab.link_meter`: each link's measured throughput, from its htb class's byte counter;
- :mod:`~gasloc_lightning.netlab.probe`: timed gloo collectives across the sites (the clock check);
- :mod:`~gasloc_lightning.netlab.shell`: the ``ip`` and ``tc`` commands.

The ``gasloc-netlab`` app (:mod:`gasloc_lightning.app.netlab`) runs elastic and static training in the lab.
Needs root; see ``docs/netlab.md``.
"""

from gasloc_lightning.netlab.faults import Fault, FaultSchedule, parse_faults
from gasloc_lightning.netlab.lab import Lab, lab_namespaces, remove_namespaces, stale_namespaces
from gasloc_lightning.netlab.plan import LabPlan, plan_lab
from gasloc_lightning.netlab.shell import LabError, check_can_build, why_no_lab

__all__ = ["Fault", "FaultSchedule", "Lab", "LabError", "LabPlan", "check_can_build", "lab_namespaces",
           "parse_faults", "plan_lab", "remove_namespaces", "stale_namespaces", "why_no_lab"]
