import pytest
import torch

from pyro_pdvi.infer.consensus import ConsensusState


@pytest.mark.parametrize("rule", ["consensus", "paper"])
def test_propose_changes_nothing_until_applied_and_keeps_invariants(rule):
    g = torch.Generator().manual_seed(0)
    step_sizes = torch.tensor([0.1, 0.2, 0.3])
    state = ConsensusState(torch.zeros(3), num_blocks=4, step_sizes=step_sizes, global_update=rule)
    for _ in range(10):
        ids = torch.randperm(4, generator=g)[:2]
        copies = torch.randn(2, 3, generator=g)
        before = state.state_dict()
        update = state.propose(ids, copies)
        for key, value in state.state_dict().items():
            assert key == "global_update" or torch.equal(value, before[key])
        state.apply(update)
        assert torch.allclose(state.dual_mean, state.duals.mean(0), atol=1e-12)
        assert torch.allclose(state.copy_mean, state.copies.mean(0), atol=1e-12)
        gamma = copies.mean(0) if rule == "paper" else state.copies.mean(0)
        assert torch.allclose(state.consensus, gamma + step_sizes * state.duals.mean(0), atol=1e-12)


def test_changing_step_sizes_moves_consensus_with_h():
    state = ConsensusState(torch.zeros(2), num_blocks=2, step_sizes=torch.ones(2))
    state.apply(state.propose(torch.tensor([0]), torch.tensor([[1.0, 2.0]])))
    state.set_step_sizes(torch.tensor([0.5, 2.0]))
    assert torch.allclose(state.consensus, state.copies.mean(0) + state.step_sizes * state.duals.mean(0))
