"""scikit-learn's common estimator checks on :class:`AnnealedKMeans` (issue 3, item 5) and
:class:`MiniBatchAnnealedKMeans`.

Small settings keep the ~55 checks fast (most of the time is loading the cached Numba
kernels for each new array type: float32, read-only memmaps).
"""
from sklearn.utils.estimator_checks import parametrize_with_checks

from fastanneal import AnnealedKMeans, MiniBatchAnnealedKMeans

# Each expected failure was read and judged; none hides a defect of the estimator.
EXPECTED_FAILED_CHECKS = {
    # The check fits once on rows repeated by their integer weight and once on the *shuffled*
    # weighted rows with the same random_state. k-means++ seeding consumes the generator
    # by row position, so the two fits start from different seeds and return the same
    # partition with permuted cluster indices (verified: ARI 1.0, inertia equal to 1e-15;
    # without the shuffle the outputs match exactly). scikit-learn's own KMeans lists the
    # same expected failure. Weights-equal-repetition with a fixed init array is asserted in
    # tests/test_estimator.py::test_integer_weights_equal_repeated_rows.
    "check_sample_weight_equivalence_on_dense_data":
        "k-means++ seeding depends on row order and the check shuffles the weighted rows: "
        "same partition up to a permutation of cluster indices (as sklearn's KMeans)",
}


# The mini-batch estimator's fit is not the same with weights as with repeated rows even
# without the shuffle (a reviewer measured ARI 0.66 between the two, J 60.38 vs 60.67): it
# seeds on an unweighted sample of rows and draws batches of them, so repeated rows are
# more likely drawn than one weighted row -- as scikit-learn's MiniBatchKMeans, which lists
# the same expected failure with that reason.
MINIBATCH_FAILED_CHECKS = {
    "check_sample_weight_equivalence_on_dense_data":
        "the seeding sample and the batches draw rows, not weight: sample_weight is not "
        "equivalent to repeated rows (as sklearn's MiniBatchKMeans)",
}


def _expected_failed_checks(estimator):
    if isinstance(estimator, MiniBatchAnnealedKMeans):
        return MINIBATCH_FAILED_CHECKS
    return EXPECTED_FAILED_CHECKS


@parametrize_with_checks(
    [AnnealedKMeans(n_clusters=3, random_state=0, n_steps=5, max_iter=3),
     MiniBatchAnnealedKMeans(n_clusters=3, random_state=0, n_steps=5)],
    expected_failed_checks=_expected_failed_checks,
)
def test_sklearn_compatible(estimator, check):
    check(estimator)
