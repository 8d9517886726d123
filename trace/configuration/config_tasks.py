"""The embedded tasks' generation parameters: ``task.kgqa`` and ``task.simulator`` of ``params.yaml``.

Part of the typed configuration (``trace.configuration.config`` re-exports both sections); split out so each file stays
one screen of concerns. Every field has a one-line doc.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """A frozen params section that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class KGQAConfig(Section):
    """Synthetic knowledge-graph multi-hop QA: generated deterministically from ``seed``."""

    num_entities: int = Field(200, ge=10, description="entities in the graph")
    num_relations: int = Field(6, ge=2, description="relation types")
    facts_per_entity: int = Field(4, ge=1, description="outgoing facts per entity (distinct relations)")
    min_hops: int = Field(1, ge=1, description="fewest relation hops in a question")
    max_hops: int = Field(3, ge=1, description="most relation hops in a question")
    num_distractors: int = Field(2, ge=0, description="distractor facts (about other entities) per fact sheet")
    ambiguous_relations: int = Field(0, ge=0, description="relations r0..r{k-1} whose fact sheets hold look-alikes")
    num_lookalikes: int = Field(1, ge=1, description="look-alike facts per ambiguous relation on a fact sheet")
    demo_confusion: float = Field(0.0, ge=0, le=1, description="solver follows a look-alike at an ambiguous hop")
    num_train: int = Field(2000, ge=1, description="training questions")
    num_eval: int = Field(200, ge=1, description="held-out evaluation questions (the dev split)")
    num_test: int = Field(0, ge=0, description="held-out test questions, drawn with the others (0 = no test split)")

    @model_validator(mode="after")
    def _hops(self) -> "KGQAConfig":
        if self.max_hops < self.min_hops:
            raise ValueError(f"max_hops={self.max_hops} < min_hops={self.min_hops}: set max_hops >= min_hops")
        if self.ambiguous_relations > self.num_relations:
            raise ValueError(f"ambiguous_relations={self.ambiguous_relations} > num_relations={self.num_relations}: "
                             "lower kgqa.ambiguous_relations")
        if self.facts_per_entity > self.num_relations:
            raise ValueError(
                f"facts_per_entity={self.facts_per_entity} > num_relations={self.num_relations}: "
                "each fact of an entity uses a distinct relation; lower facts_per_entity")
        return self


class SimulatorConfig(Section):
    """Martingale simulator with known truth (benchmarks)."""

    num_prompts: int = Field(2000, ge=1, description="prompts, each with a latent success probability")
    difficulty_alpha: float = Field(0.3, gt=0, description="Beta(a, b) of latent p: a < 1, b < 1 gives a U-shape")
    difficulty_beta: float = Field(0.3, gt=0, description="second Beta parameter of latent p")
    min_turns: int = Field(2, ge=1, description="fewest turns of a trajectory")
    max_turns: int = Field(6, ge=1, description="most turns of a trajectory")
    step_concentration: float = Field(4.0, gt=0, description="Beta step concentration: smaller moves V faster")
    mean_tokens_per_turn: float = Field(40.0, gt=0, description="mean generated tokens per turn")
