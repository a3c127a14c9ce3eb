"""What the network learners (SISA, the mlp and game learners) share as scikit-learn
classifiers: their fitted state is one object in ``state_`` with the live records in
``state_.records``; inputs are checked the same way at ``fit`` and at prediction.
See docs/DESIGN.md (Training as a function of the SET of records)."""

from __future__ import annotations

from typing import Any, Self

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from jobs.learners.base import Learner, check_features, training_ids

_DTYPES = (np.float64, np.float32)


class NetworkClassifier(ClassifierMixin, Learner, BaseEstimator):
    """A learner whose fitted state is ``state_`` (its class says of what type)."""

    state_: Any

    def _fitted(self) -> Any:
        check_is_fitted(self, "state_")
        return self.state_

    def _training_data(self, X: Any, y: Any,
                       record_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``fit``'s records as (unique ids, finite float32 features, labels); sets
        ``n_features_in_``. The ids default to the row numbers."""
        X, y = validate_data(self, X, y, dtype=_DTYPES)
        check_classification_targets(y)
        rids = training_ids(record_ids, len(X))
        return rids, check_features(X, len(rids), None, dtype=np.float32), y

    def _label_set(self, y: np.ndarray, *, min_classes: int) -> np.ndarray:
        """``classes_``: the ``classes`` parameter (sorted unless of mixed types), or the
        labels present; at least ``min_classes`` (1 or 2) of them."""
        given = getattr(self, "classes", None)
        if given is None:
            classes = np.unique(y)
        else:
            classes = np.asarray(list(given))
            if len(np.unique(classes)) != len(classes):
                raise ValueError("classes contains duplicates")
            if classes.dtype != object:
                classes = np.sort(classes)
        if len(classes) < min_classes:
            least = "one class" if min_classes == 1 else "two classes"
            raise ValueError(f"need at least {least}, got {len(classes)} class(es): "
                             f"{classes.tolist()}")
        return classes

    def _queries(self, X: Any) -> np.ndarray:
        """Rows to predict, as finite float32 features of the fitted width."""
        X = validate_data(self, X, reset=False, dtype=_DTYPES, ensure_min_samples=0)
        return check_features(X, None, self.n_features_in_, dtype=np.float32)

    def predict(self, X: Any) -> np.ndarray:
        """Labels: argmax of :meth:`scores`, ties to the lowest class index."""
        self._fitted()
        return super().predict(X)

    @property
    def n_classes_(self) -> int:
        return len(self.classes_)

    @property
    def record_ids_(self) -> np.ndarray:
        """Live record ids, sorted."""
        return self._fitted().records.ids

    @property
    def X_(self) -> np.ndarray:
        """Features of the live records (float32), in ``record_ids_`` order."""
        return self._fitted().records.X

    @property
    def y_(self) -> np.ndarray:
        """Class indices of the live records."""
        return self._fitted().records.y

    @property
    def platform_(self) -> dict[str, Any]:
        """Where the model was trained (device type, torch build...): the bits depend on it."""
        return self._fitted().platform

    @classmethod
    def _restored(cls, params: dict[str, Any], state: Any, n_features: int,
                  classes: np.ndarray) -> Self:
        """A learner with these parameters holding a loaded ``state``."""
        self = cls(**params)
        self.n_features_in_ = n_features
        self.classes_ = classes
        self.state_ = state
        return self


class SpecClassifier(NetworkClassifier):
    """A network classifier whose state says what it trains under in ``state_.spec`` (a
    :class:`~jobs.learners.networks.training_spec.TrainingSpec`)."""

    @property
    def config_(self) -> dict[str, Any]:
        """The configuration its networks train under (resolved from the parameters)."""
        return self._fitted().spec.config

    @property
    def seed_(self) -> int:
        """The seed of every keyed choice (drawn at fit when ``random_state`` is None)."""
        return self._fitted().spec.seed

    @property
    def device_(self) -> torch.device:
        return self._fitted().spec.device
