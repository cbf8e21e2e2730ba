"""What every config table is: frozen, strict about types and keys, every float finite, and built
directly (`TrainConfig(lr=...)`) or read from a file, a failure is one line naming the field."""

from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo

from train.config.errors import one_line

OpenFraction = Annotated[float, Field(gt=0, lt=1)]
SAVED = "saved"  # the validation context's key: True while reading a config a run saved (`from_dict`)


def is_saved(info: ValidationInfo) -> bool:
    """Whether the table is read back from a run (`ExperimentConfig.from_dict`), not made now."""
    return bool((info.context or {}).get(SAVED))


class _OneLineErrors(type(BaseModel)):
    """Building a table directly, `TrainConfig(lr=...)`, raises one line naming the field (`one_line`).

    Here, not in `__init__`: a table with its own `__init__` is validated through it, in Python
    mode, even by `model_validate_json`."""

    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as err:
            raise one_line(err, cls._where, cls.table_keys()) from None


class Table(BaseModel, metaclass=_OneLineErrors):
    """A frozen config table: strict types, unknown keys refused, every float finite.

    `allow_inf_nan=False` reaches the dataclasses a table holds too (pydantic validates a stdlib
    dataclass with its parent's config): `model.norm_eps=inf` is refused like `train.lr=inf`."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)
    _where: ClassVar[str]  # how errors name this table when it is built directly

    @classmethod
    def table_keys(cls) -> dict[str, list[str]]:
        """The known keys of each table this one holds, by its name: what an unknown key's error lists.
        None here; `ExperimentConfig` holds the tables."""
        return {}

    def replace(self, **changes: Any) -> Self:
        """A copy with `changes`, checked as a new table is."""
        return type(self)(**{**dict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain values: what config.json holds (a mesh as its "data:D,fsdp:F,tensor:T" text)."""
        return self.model_dump()
