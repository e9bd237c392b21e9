// Times the browser device's secure aggregation under Node (bench/secagg.py runs it; secagg-round.js says what).
// Usage: node bench/web/secagg.mjs '{"config": {...}, "plan": {...}, "base_size": d}'; prints JSON.

import { TimedRound } from './secagg-round.js';

const round = new TimedRound(JSON.parse(process.argv[2]));
await round.keys();
await round.shareOthers();
console.log(JSON.stringify(await round.timedRest()));
