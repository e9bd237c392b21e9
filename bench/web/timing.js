// @ts-nocheck
// The bench's timed steps, shared by the browser page (bench.js) and the Node + Dawn runner (../webgpu/run.mjs):
// the full and personal-only steps of an opened engine, samples (images, or a text bundle's windows) per second after
// untimed warm-up steps.

/**
 * Time `engine`'s full and personal-only steps on seeded inputs; the fields of the bench's report.
 * @param {{steps: number, warmup: number, numClasses: number}} options
 */
export async function timeSteps(engine, { steps, warmup, numClasses }) {
  const size = engine.batchSize;
  // seeded inputs (a fixed LCG): the timings do not depend on the values, the run must not depend on Math.random
  let state = 12345;
  const next = () => ((state = (Math.imul(state, 1103515245) + 12345) >>> 0) / 2 ** 32);
  // pixels in [-1, 1), or token ids below the vocabulary's size for a bundle whose input is integer (a text model)
  const integer = engine.inputType.dtype !== 'float32';
  const draw = integer ? () => Math.floor(next() * numClasses) : () => next() * 2 - 1;
  const values = Array.from({ length: size * engine.sampleSize }, draw);
  const x = integer ? BigInt64Array.from(values, BigInt) : Float32Array.from(values);
  // one label a sample, or a next-word sample's target at every position (engine.targetSize of them)
  const y = Int32Array.from({ length: size * engine.targetSize }, () => Math.floor(next() * numClasses));
  const result = { batchSize: size };
  for (const set of ['full', 'personal']) {
    const first = performance.now();
    // the first step's loss: engines that compute the same values agree on it (bench/webgpu checks a layout by it)
    result[`${set}FirstLoss`] = await engine.trainStep(x, y, size, 0.01, set);
    result[`${set}FirstStepSeconds`] = (performance.now() - first) / 1000; // includes creating the session
    for (let i = 1; i < warmup; i++) await engine.trainStep(x, y, size, 0.01, set);
    const started = performance.now();
    for (let i = 0; i < steps; i++) await engine.trainStep(x, y, size, 0.01, set);
    const seconds = (performance.now() - started) / 1000;
    result[`${set}ImagesPerSecond`] = (steps * size) / seconds;
    result[`${set}VariantSteps`] = engine.variantSteps;
  }
  result.placements = Object.fromEntries(engine.placements); // where each graph ran (all 'webgpu' on a GPU, or why not)
  return result;
}
