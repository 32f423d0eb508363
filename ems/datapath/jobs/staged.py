"""A V0 load from pool nodes (`StagedLoad`): V0 staging has no room for the headers, so the values are received as
the pool returns them (one batch), their present prefix verified, copied into staging (then to the device), and
scattered. Nothing after the first miss is written; the lease goes back on every path.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from ems.buffers import Buffer
from ems.datapath.jobs.transfer import JobContext, Loaded, ReceivedValues, Transfer, pool_call
from ems.datapath.planning import RawPlan
from ems.records import Stage
from ems.store.value_format import HEADER_SIZE


class StagedLoad:
    """A V0 load from pool nodes (its staging has no room for the headers): see the module docstring."""

    def __init__(self, transfer: Transfer, context: JobContext) -> None:
        if not isinstance(transfer.plan, RawPlan):
            raise TypeError("StagedLoad moves V0 values (a RawPlan): V1 loads from pool nodes are PipelinedLoad's")
        self.plan: RawPlan = transfer.plan
        self.device, self.copier = transfer.device, transfer.copier
        self.option, self.record = transfer.option, transfer.record
        self.pool, self.staging = context.pool, context.staging
        self.record.path = "staged"

    def run(self) -> Loaded:
        return self._receive_copy_scatter(self.plan)

    def _receive_copy_scatter(self, plan: RawPlan) -> Loaded:
        """V0 (its staging has no room for the headers): receive, verify the prefix, copy it into staging, scatter."""
        record = self.record
        with record.stage(Stage.RECEIVE):
            outcome = self.pool.get(pool_call(plan, self.option))
        with record.stage(Stage.VERIFY, plan.expected.payload_bytes()):
            # nothing more where the pool checked each value against the expected ones (replicas: to fall back on
            # damage), else every present value (`ReceivedValues.verified_prefix`)
            hits = ReceivedValues(outcome.results, plan.expected, self.pool.read_check).verified_prefix()
        if hits:
            nbytes = int(plan.value_start[hits])
            lease = self.staging.acquire(nbytes, self.device)
            try:
                with record.stage(Stage.COPY, nbytes):
                    present = cast(list[Buffer], outcome.results[:hits])  # the first `hits` are present
                    _fill_from_values(plan, lease.host_array(), present)
                    with self.copier.device_work():
                        lease.copy_to_device(0, nbytes)
                with record.stage(Stage.SCATTER, plan.expected.payload_bytes(0, hits)):
                    with self.copier.device_work():
                        self.copier.scatter(plan, lease.device, 0, hits)
            finally:
                self.staging.release(lease)
        return Loaded(hits, outcome)


def _fill_from_values(plan: RawPlan, host: np.ndarray, values: list[Buffer]) -> None:
    """The payloads of the leading values (verified) into their places in staging (V0 staging holds no headers)."""
    starts = plan.value_start.tolist()
    for i, value in enumerate(values):
        host[starts[i] : starts[i + 1]] = np.frombuffer(value, dtype=np.uint8, offset=HEADER_SIZE)
