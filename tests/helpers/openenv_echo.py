"""An OpenEnv environment written with openenv-core's own API, as an environment's author would (tests/test_openenv.py):
the Action and Observation models, the server-side `Environment`, its typed `EnvClient`, and the FastAPI app its
`HTTPEnvServer` serves, which keeps the count of open sessions (`active_sessions`).

The server scores each step: 1 / (1 + the message's length), 0.5 more when shouted. It records every reward it gives
(`EchoEnvironment.given`), the seeds it was reset with, and how many environment objects it made and closed.
Saying "bye" ends the episode."""

from fastapi import FastAPI
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import Action, Environment, HTTPEnvServer, Observation, State
from pydantic import Field


class EchoAction(Action):
    """Say something to the echo environment."""

    message: str = Field(..., description="The words to say")
    loud: bool = Field(default=False, description="Whether to shout them")


class EchoObservation(Observation):
    heard: str = Field(default="", description="What the environment heard")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    made = 0
    closed = 0
    given: list[float] = []
    seeds: list[int | None] = []

    def __init__(self):
        super().__init__()
        type(self).made += 1
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        type(self).seeds.append(seed)
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(heard="Say hello.")

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        reward = 1 / (1 + len(action.message)) + (0.5 if action.loud else 0.0)
        type(self).given.append(reward)
        heard = action.message.upper() if action.loud else action.message
        return EchoObservation(heard=heard, reward=reward, done=action.message == "bye")

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        type(self).closed += 1

    @classmethod
    def forget(cls):
        cls.made, cls.closed, cls.given, cls.seeds = 0, 0, [], []


class EchoClient(EnvClient[EchoAction, EchoObservation, State]):
    def _step_payload(self, action: EchoAction) -> dict:
        return {"message": action.message, "loud": action.loud}

    def _parse_result(self, payload: dict) -> StepResult[EchoObservation]:
        reward, done = payload.get("reward"), payload.get("done", False)
        observation = EchoObservation(**payload.get("observation", {}), reward=reward, done=done)
        return StepResult(observation=observation, reward=reward, done=done)

    def _parse_state(self, payload: dict) -> State:
        return State(**payload)


def echo_app(max_sessions: int = 16) -> tuple[FastAPI, HTTPEnvServer]:
    """The app serving `EchoEnvironment` (what `create_app(EchoEnvironment, EchoAction, EchoObservation,
    max_concurrent_envs=...)` builds) and its server object, which counts the open sessions."""
    server = HTTPEnvServer(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=max_sessions)
    app = FastAPI()
    server.register_routes(app)
    return app, server
