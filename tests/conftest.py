import pytest
import torch
from datasets import Dataset

from grpo.testing import save_tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def prompt_dataset():
    return Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(16)], "answer": ["3"] * 16})


@pytest.fixture
def chat_dataset():
    prompts = [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(8)]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(i + 1) for i in range(8)]})
