// The device contract as the page reads it: round settings accepted and refused exactly as the Python device does
// (RoundSettings.from_json's verdicts, written by make_fixtures.py), defaults filled in from the contract.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { checkedSettings, parseContract, roundSettings } from '../src/contract.js';
import { DeviceError } from '../src/errors.js';
import { NEEDS_FIXTURES, expected, fixtureContract } from './fixtures.mjs';

test('round settings are refused exactly where the Python device refuses them, naming the same setting', {
  skip: NEEDS_FIXTURES,
}, () => {
  const contract = fixtureContract();
  const cases = expected().settings_cases;
  assert.ok(cases.length > 30 && cases.some((c) => c.problem === null) && cases.some((c) => c.problem !== null));
  for (const { settings, problem } of cases) {
    const what = JSON.stringify(settings);
    if (problem === null) {
      const taken = checkedSettings(contract, settings);
      for (const [name, value] of Object.entries(settings))
        if (name in contract.settings) assert.deepEqual(taken[name], value, what);
      continue;
    }
    assert.throws(
      () => checkedSettings(contract, settings),
      (err) => {
        assert.ok(err instanceof DeviceError, what);
        const field = (line) => line.replace("the server's round settings are invalid: ", '').split(' ')[0];
        assert.equal(field(err.problem), field(problem), `${what}: ${err.problem} vs Python's ${problem}`);
        assert.equal(err.problem.split(' ').slice(0, 5).join(' '), "the server's round settings are", what);
        return true;
      },
    );
  }
  assert.throws(() => checkedSettings(contract, [1]), /settings are a list, not an object/);
});

test("absent settings take the contract's defaults; unknown ones are dropped", { skip: NEEDS_FIXTURES }, () => {
  const contract = fixtureContract();
  const defaults = Object.fromEntries(Object.entries(contract.settings).map(([name, spec]) => [name, spec.default]));
  assert.deepEqual(roundSettings(contract, null), defaults);
  assert.deepEqual(checkedSettings(contract, { epochs: 3, momentum: 0.9 }), { ...defaults, epochs: 3 });
  const a = roundSettings(contract, {});
  a.kept_on_device.push('x');
  assert.deepEqual(roundSettings(contract, {}).kept_on_device, [], 'a default is never shared between rounds');
});

test('a contract of another version is refused with one line naming the fix', { skip: NEEDS_FIXTURES }, () => {
  assert.throws(
    () => parseContract({ ...fixtureContract(), version: 99 }),
    (err) => err instanceof DeviceError && /version 99/.test(err.problem) && /reload the page/.test(err.fix),
  );
  assert.throws(() => parseContract('<html>'), DeviceError);
});
