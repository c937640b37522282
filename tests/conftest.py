import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


class TiedLanguageModel(nn.Module):
    """Tied input and output embeddings (as in GPT-2): the output projection reuses the
    embedding's weight, so one parameter is used twice per example."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


@pytest.fixture
def tied_language_model():
    """A fresh ``TiedLanguageModel`` (7 tokens, width 4), initialised after ``_seed``."""
    return TiedLanguageModel()
